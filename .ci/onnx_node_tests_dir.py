"""Prints the ONNX backend node test directory of the installed `onnx` package.

`make test` hands it to the engine's tests as TENSORFLEET_ONNX_NODE_TESTS. Found without
importing onnx (that takes a second); exits 1 when the package lacks the test data.
"""

import importlib.util
import os
import sys

spec = importlib.util.find_spec("onnx")
if spec is None or not spec.submodule_search_locations:
    sys.exit("onnx is not installed in " + sys.prefix + "; run .ci/deps.sh")
node = os.path.join(spec.submodule_search_locations[0], "backend", "test", "data", "node")
if not os.path.isdir(node):
    sys.exit(node + " does not exist: this onnx release ships no node test data (pin onnx<=1.22)")
print(node)
