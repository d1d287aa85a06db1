"""The runners' names, apart from the runners (which import onnx, onnxruntime and torch), so that
`rope-export check --help` can list them at once."""

RUNNERS = ("onnx-reference", "cpu-twin", "onnxruntime-cpu", "onnxruntime-cuda", "tensorrt")
