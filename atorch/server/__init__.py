"""The strategy server: the planner's ask/tell as an authenticated HTTP + JSON service on an Optuna storage.

``atorch serve`` runs it (``atorch.server.app``); ``atorch.strategy_search.search.remote.RemotePlanner`` searches
against it.
"""
