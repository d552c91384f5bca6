"""The peers' own trainers read an hsx run in place, local directory or S3, through hsx_reader.

- ``hsx_peers.speculators``: an hs-connectors backend named ``hsx`` for ``speculators train``
  (``python -m hsx_peers.speculators train ...`` registers it, then runs speculators' own trainer).
- ``hsx_peers.specforge``: a SpecForge ``FeatureStore`` and the ``SampleRef`` list of a run, and
  ``python -m hsx_peers.specforge train -c run.yaml --hsx-store ...``: SpecForge's own ``specforge train``
  with ``data.hidden_states_path: hsx://R`` read in place through them.
- ``hsx_peers.evaluate``: a SpecForge DFlash drafter measured against its target by SpecForge's own
  ``spec_generate`` (greedy) and teacher-forced on a run's stored states; what ``hsx evaluate`` runs.

Imports only hsx, hsx_reader and hsx_tools of this repository, and the peer's package.
"""
