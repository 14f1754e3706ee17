"""`python -m bench.cost`: what a rented GPU-hour buys under each autoscaling policy, on a simulated clock, beside
the clairvoyant bound. See docs/benchmarks-cost.md."""
