"""`qgemm serve`'s process family, one module a part:

- contract.py    the messages between fronts and engines, declared once (msgspec Structs), and how errors cross
- channel.py     the Unix socket that carries them, a frame per loop turn
- arenas.py      the fronts' shared memory, where X and Y sit (never on the channel)
- front.py       a front's Service: the routes' questions asked of the engines
- engine.py      an engine process: one device, its weights and its batching, a frame's requests at once
- supervisor.py  starts the fronts and an engine per device, restarts what dies, stops them all

The one-process deployments (TestClient, `--fronts 0`, a Ray Serve replica) serve the same routes with the engine
in process (app/service.py's LocalService); every deployment checks a request in app/checks.py.
"""
