"""An exported model's TFLite signatures behind typed, checked methods: what the device runs, and
what the server runs on its own (public) data when it mixes centralized data into training.

Needs numpy, the contracts and a TFLite interpreter (`ai_edge_litert`, whose `CompiledModel` is a
backend too, or `tflite_runtime`), never TensorFlow; it imports neither the device runtime nor the
server, so both can stand on it.
"""
