"""What the search and the cluster planner plan with: a model's statistics measured on fake tensors
(``analyser``), the user's mistakes the same fake step finds (``diagnosis``), the machines' hardware profile
(``hardware``, ``parallel_costs``, the tables in ``profiles/``), the cost model's predictions (``cost_model``) and
memory traced on fake tensors (``tracing``, ``fake_kernels``), all on the fake copy of the model and batch
(``fake_step``). It imports neither the search nor the cluster planner.
"""
