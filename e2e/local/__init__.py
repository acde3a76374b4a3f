"""The local-fleet suite's harness: a Kubernetes API (kmock), the real operator, real engines and a real router.

- kube.py: kmock's emulator, made a little more like an API server, in a thread of its own;
- processes.py: `chunkwise serve` / `chunkwise router` / the operator as child processes on 127.0.0.x;
- fleet.py: `LocalFleet`, which plays the Deployment controller and the kubelet: one real process per
  desired replica, published as Pod and EndpointSlice objects;
- load.py: bounded request loops through the router, with per-request timings;
- step_load.py: the step-load scenario (`python -m e2e.local.step_load`), shared with tests/fleet.

Loopback only: every process listens on a 127.0.0.x address, and all traffic stays on this machine.
"""
