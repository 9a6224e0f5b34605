from remat_dist.cli.main import main

raise SystemExit(main())
