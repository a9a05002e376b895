"""The fast in-process simulation: rounds in one process with the export's `.tflite` signatures
doing every device's maths and the orchestrator's aggregation committing them (`rounds`), the
evaluation protocol's splits (`protocol`), the client tasks on threads or Ray workers (`clients`,
`ray_clients`), and `python -m android_sim simulate` (`command`, `simulate`, `ranking`,
`predictions`, `tune`)."""
