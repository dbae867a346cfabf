from statetool.cli import main

main()
