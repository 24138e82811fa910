"""The controller: kopf handlers, reconcile, the pure pipeline, conditions, the API client, leader election.

Imports the layers below (api/, engine/, planning/, rendering/); nothing below imports it.
"""
