"""The top layer: what people and CI run on top of the system (the `pulse` command, the demo, the
benchmarks, the soak and goodput campaigns) and the harness they share with the tests (free ports,
private servers). It may import everything below it: the contract (``clusterpulse``) and the
three programs (``agent``, ``services``, ``trainer``); nothing below imports it."""
