from bench.chaos.run import main

main()
