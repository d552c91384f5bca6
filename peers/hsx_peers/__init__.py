"""The peers' own trainers read an hsx run in place, local directory or S3, through hsx_reader.

- ``hsx_peers.speculators``: an hs-connectors backend named ``hsx`` for ``speculators train``
  (``python -m hsx_peers.speculators train ...`` registers it, then runs speculators' own trainer).
- ``hsx_peers.specforge``: a SpecForge ``FeatureStore`` and the ``SampleRef`` list of a run, for SpecForge's
  own loader and trainer (``build_disagg_offline_runtime(feature_store=..., refs=...)``).

Imports only hsx, hsx_reader and hsx_tools of this repository, and the peer's package.
"""
