from bench.peers.run import main

main()
