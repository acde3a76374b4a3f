from chunkwise.engine.kernels import main

raise SystemExit(main())
