"""ATorch's ``atorch.auto.opt_lib`` package: the documented modules, as aliases of ``atorch.opt_lib``."""
