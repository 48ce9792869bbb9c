"""Ray actors: thin adapters that host engine objects and per-request state.

One actor per neural SSM (``ssm.SSMActor``), one merge actor (``merge.MergeActor``, which
also runs the model-free suffix proposer, ``suffix.SuffixDrafter``) and one verifier
(``verifier.VerifierActor``). The algorithms live in ``engine``; these classes only keep state
keyed by request id, time it out, and move plain values across process boundaries.
``backend.ActorBackend`` is the transport that ``engine.step.Session`` runs one request's
draft -> merge -> verify -> commit over;
``group.ActorGroup`` creates and owns the actors.

The classes are plain Python; ``group.launch`` wraps them with ``ray.remote`` and the options
from the config, so they can also be used (and unit tested) in-process.
"""
