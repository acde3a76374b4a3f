"""chunkwise's control plane: a Kopf operator for InferenceService resources.

Deliberately empty of imports: the operator image carries neither torch nor the engine, and importing this
package must not pull them in (tests/operator checks it in a fresh interpreter).
"""
