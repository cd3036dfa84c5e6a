"""The cluster planner, ``atorch plan``: layouts of a transformer on a cluster that is not here, ranked by the
cost model (``cluster_plan``, ``plan_cli``), with the transformer terms it predicts by (``plan_terms``), the shape
planned for (``model_shapes``) and the precision regimes (``precision``). It plans with ``costing`` and does not
import the search.
"""
