from tollway.cli import main

raise SystemExit(main())
