"""The API layer (bottom): the CRD schema source, the parser to Spec, quantities, errors, operator settings,
and the one bounded HTTP GET (fetch) that the exporter and the operator's probe share.

Imports nothing above it (spec.py reads engine/images.py, the other bottom room); every layer may import it.
"""
