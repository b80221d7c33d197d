from unified.cli import main

main()
