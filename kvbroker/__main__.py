from kvbroker.cli import main

main()
