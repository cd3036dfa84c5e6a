"""The strategy search of fully automatic mode: the space of candidates (``space``, ``candidates``), the study
(``ask_tell``, ``planner``; ``remote``: the same loop over a strategy server's study, with its client and
``retry``), the dry-runs' judgement (``automatic``, ``entry``, ``buildable``, ``outcome``) and what a search tells
(``progress``, ``report``, ``describe``). It plans with ``costing`` and never imports the server or the cluster
planner.
"""
