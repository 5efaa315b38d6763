"""The benchmark harness: cells and grids, running them, the results database and the report.

- :mod:`~aqr.harness.cells`: what one cell is (plain data) and what it produced;
  :mod:`~aqr.harness.keys`: its key in the results database; :mod:`~aqr.harness.specs`,
  :mod:`~aqr.harness.presets`, :mod:`~aqr.harness.grid_files`: grids of cells in Python, the paper's
  presets, YAML/JSON files.
- :mod:`~aqr.harness.inputs`, :mod:`~aqr.harness.source_stats`: what a cell reads (model, images,
  cached source statistics); :mod:`~aqr.harness.eval_loop`, :mod:`~aqr.harness.cell_run`,
  :mod:`~aqr.harness.continual`: running one cell; :mod:`~aqr.harness.realtime`: the realtime protocol
  (its rule, its costs file, its timing rounds).
- :mod:`~aqr.harness.grid_driver`: running a grid on an executor (:mod:`~aqr.harness.executors`,
  :mod:`~aqr.harness.ray_executor`), claiming cells (:mod:`~aqr.harness.claims`) and recording rows
  (:mod:`~aqr.harness.results`) with their :mod:`~aqr.harness.provenance`.
- :mod:`~aqr.harness.report`: tables and figures from a results database.

The benchmark scripts live in the repository's ``benchmarks/`` folder.
"""
