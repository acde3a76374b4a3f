from chunkwise.kernels import main

raise SystemExit(main())
