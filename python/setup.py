# moefold_torch: moefold's MoE layer as a PyTorch module on the trainer's process groups.
#   pip install --no-build-isolation ./python      (torch must be installed first)
# The torch-facing unit (csrc/binding.cpp, g++) is the only one that includes torch's headers; the
# layer is compiled in two units that include none (csrc/layer_f32_f64.cpp, layer_bf16.cpp, behind
# csrc/layer_api.hpp), so they build in parallel with it (MAX_JOBS, with ninja): three units of
# about a minute each here, about 70 s with two jobs. moefold's headers come
# from ../include. -g0: setuptools adds Python's -g, which makes the binding unit 16 MB and 119 s
# instead of 74 s.
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
include = os.path.normpath(os.path.join(here, "..", "include"))
if not os.path.isfile(os.path.join(include, "moefold", "moefold.hpp")):
    raise RuntimeError(f"moefold_torch: moefold's headers are not at {include}: build it from "
                       "the moefold source tree (pip install --no-build-isolation ./python)")

setup(
    name="moefold_torch",
    version="0.1.0",
    description="moefold's MoE layer as a PyTorch module on the trainer's process groups",
    packages=["moefold_torch"],
    ext_modules=[
        CppExtension(
            "moefold_torch._C",
            sources=["csrc/binding.cpp", "csrc/layer_f32_f64.cpp", "csrc/layer_bf16.cpp"],
            include_dirs=[include],
            extra_compile_args=["-std=c++20", "-O2", "-g0", "-Wall", "-Wextra"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.10",
)
