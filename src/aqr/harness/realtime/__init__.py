"""The realtime protocol: the stream runs at the speed of the plain model and charges each method its time.

After Alfarra et al., "Evaluation of Test-Time Adaptation Under Computational Time Constraints"
(ICML 2024): a batch arrives every time unit (one plain forward pass). A method whose step costs ``C``
units adapts on the batch in front of it when it is free and is busy for ``C`` units; batches that
arrive meanwhile are not adapted on, and are predicted by the state the method holds from its last
adapted batch (:meth:`aqr.methods.TTAMethod.forward_held`; the unadapted model for a method that keeps
no state across batches). So ``C <= 1`` adapts on every batch, ``C = 1.5`` on batches 0, 2, 4, ...
and ``C = 3`` on 0, 3, 6, ...

``C`` of a (model, method, batch size) comes from a timing round on the running machine or from a
costs file, so a committed run can be repeated exactly: ``C`` is part of a realtime cell's key
(``Cell.cost``, two decimals).

The protocol's parts, one module each by job:

- :mod:`~aqr.harness.realtime.rule`: which batches a method of cost ``C`` adapts on
  (:func:`~aqr.harness.realtime.rule.adapted_batches`), what running a realtime cell needs;
- :mod:`~aqr.harness.realtime.costs`: the costs file (:class:`~aqr.harness.realtime.costs.CostTable`),
  its keys, and realtime cells keyed with their costs;
- :mod:`~aqr.harness.realtime.timing`: the timing rounds that measure ``C``
  (:func:`~aqr.harness.realtime.timing.measure_cost`, :func:`~aqr.harness.realtime.timing.resolve_costs`),
  which build the methods and so import :mod:`aqr.harness.cell_run`.

This ``__init__`` imports none of them on purpose: :mod:`aqr.harness.cell_run` imports the rule, and
importing the package must not pull in the timing rounds that import :mod:`aqr.harness.cell_run` back.
"""
