from mlatune.entry import main

main()
