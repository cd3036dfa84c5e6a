"""The strategy server: the planner's ask/tell as an authenticated HTTP + JSON service on an Optuna storage.

``atorch serve`` runs it (``atorch.server.app``); ``atorch.server.client.RemotePlanner`` searches against it.
"""
