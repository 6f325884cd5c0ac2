from peer.cli.app import main

raise SystemExit(main())
