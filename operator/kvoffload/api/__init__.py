"""The API layer (bottom): the CRD schema source, the parser to Spec, quantities, errors, operator settings.

Imports nothing else of kvoffload's; every other layer may import it.
"""
