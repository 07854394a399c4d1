from prune_heads_cli.main import main

main()
