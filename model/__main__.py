from model.cli import main

raise SystemExit(main())
