#!/usr/bin/env python3
"""Consumer tests of an installed moefold.

Installs the build (meson install with DESTDIR), moves the installed tree to another directory,
and then builds and runs, against that moved copy only, three small projects: one with CMake
(find_package), and one with meson (meson_consumer) twice: through pkg-config, and with moefold
as a subproject from a wrap file (its source package in subprojects/packagecache). Each builds
consumer.cpp (the mesh and the CPU layer) and, when nvcc is given, kernels.cu (the kernel headers).
No header may come from the source or build tree: every header each build read (ninja -t deps)
is checked. Each check is one case of the doctest-style summary line at the end.

Usage: consumers.py --source S --build B --meson MESON --cmake CMAKE --cxx CXX
                    [--nvcc NVCC] [--nccl] [--mpi]"""
import argparse
import hashlib
import json
import os
import re
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

ap = argparse.ArgumentParser()
ap.add_argument("--source", required=True)
ap.add_argument("--build", required=True)
ap.add_argument("--meson", required=True, nargs="+")
ap.add_argument("--cmake", required=True)
ap.add_argument("--cxx", required=True)
ap.add_argument("--nvcc", default="")
ap.add_argument("--nccl", action="store_true")
ap.add_argument("--mpi", action="store_true")
ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
args = ap.parse_args()
if args.nvcc:
    args.nvcc = shutil.which(args.nvcc) or args.nvcc
args.cxx = shutil.which(args.cxx) or args.cxx

source = pathlib.Path(args.source).resolve()
build = pathlib.Path(args.build).resolve()
here = source / "tests" / "packaging"
meson = args.meson
tmp = pathlib.Path(tempfile.mkdtemp(prefix="moefold-consumers-"))

# A clean environment: nothing that points compilers or package tools at other places.
env = {k: v for k, v in os.environ.items()
       if not k.startswith(("MESON", "PKG_CONFIG", "CMAKE_", "CPATH", "C_INCLUDE", "CPLUS_INCLUDE",
                            "LIBRARY_PATH", "DESTDIR", "CXX", "CC", "CUDA"))}
env["CXX"] = args.cxx
empty_pc = tmp / "no-pkgconfig"
empty_pc.mkdir()

passed, failed, skipped = 0, 0, 0


class Failure(Exception):
    pass


def run(cmd, cwd=None, extra_env=None):
    e = dict(env, **(extra_env or {}))
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=e, capture_output=True, text=True)
    if r.returncode != 0:
        raise Failure(f"$ {' '.join(map(str, cmd))}\nexit {r.returncode}\n{r.stdout[-2500:]}\n{r.stderr[-4000:]}")
    return r.stdout


def case(name, fn, skip_reason=None):
    global passed, failed, skipped
    if skip_reason:
        print(f"[skip] {name}: {skip_reason}")
        skipped += 1
        return
    try:
        detail = fn()
        print(f"[ok] {name}" + (f": {detail}" if detail else ""))
        passed += 1
    except Failure as e:
        print(f"[FAIL] {name}\n{e}")
        failed += 1


def headers_read(build_dir):
    """Every file the build's compilations read, from ninja's dependency log."""
    out = run(["ninja", "-C", build_dir, "-t", "deps"])
    return {(pathlib.Path(build_dir) / line.strip()).resolve() for line in out.splitlines()
            if line.startswith("    ")}


def check_out_of_reach(build_dir, must_come_from):
    deps = headers_read(build_dir)
    moefold = [d for d in deps if "moefold" in d.parts and d.suffix in (".hpp", ".cuh")]
    for d in deps:
        if d.is_relative_to(source) or d.is_relative_to(build):
            raise Failure(f"{d} was read from moefold's source or build tree")
    if not moefold or not all(d.is_relative_to(must_come_from) for d in moefold):
        raise Failure(f"moefold headers not all from {must_come_from}: {sorted(moefold)[:5]}")
    return len(moefold)


def copy_project(name, dst_name=None):
    dst = tmp / (dst_name or name)
    shutil.copytree(here / name, dst)
    for f in (here / "consumer").iterdir():
        shutil.copy(f, dst)
    return dst


# 1. Install with DESTDIR, then move the tree: the copy under test is at `prefix`.
opts = json.loads(run(meson + ["introspect", "--buildoptions", build]))
orig_prefix = next(o["value"] for o in opts if o["name"] == "prefix")
stage = tmp / "stage"
prefix = tmp / "moved" / "moefold-0.1"
state = {}


def install():
    run(meson + ["install", "-C", build, "--no-rebuild", "--quiet", "--destdir", stage])
    staged = stage / orig_prefix.lstrip("/")
    prefix.parent.mkdir(parents=True)
    shutil.move(str(staged), str(prefix))
    shutil.rmtree(stage)
    need = ["include/moefold/moefold.hpp", "include/moefold/version.hpp",
            "include/moefold/kernels/group_table.cuh", "bin/moefold-mesh",
            "share/doc/moefold/LICENSE", "share/doc/moefold/install.md",
            "share/cmake/moefold/moefoldConfig.cmake",
            "share/cmake/moefold/moefoldConfigVersion.cmake", "share/cmake/moefold/FindNCCL.cmake"]
    missing = [n for n in need if not (prefix / n).exists()]
    pcs = list(prefix.rglob("moefold.pc"))
    if missing or len(pcs) != 1:
        raise Failure(f"missing from the installed tree: {missing + ([] if pcs else ['moefold.pc'])}")
    state["pcdir"] = pcs[0].parent
    if "Apache License" not in (prefix / "share/doc/moefold/LICENSE").read_text():
        raise Failure("LICENSE is not the Apache-2.0 text")
    # Relocatable: no installed metadata names where it was built or first installed.
    for f in [pcs[0]] + list((prefix / "share/cmake/moefold").iterdir()):
        text = f.read_text()
        for bad in (source, build, stage, orig_prefix):
            if re.search(re.escape(str(bad)) + r"(?![\w.-])", text):
                raise Failure(f"{f.name} names {bad}: not relocatable")
    # The tools run from the moved tree.
    out = run([prefix / "bin/moefold-mesh", "--world", "8", "--tp", "2", "--ep", "4", "--etp", "1"])
    if not out.strip():
        raise Failure("moefold-mesh printed nothing")
    return f"{sum(1 for _ in prefix.rglob('*') if _.is_file())} files, moved to {prefix}"


case("install (DESTDIR, moved prefix)", install)
installed = "pcdir" in state
no_install = None if installed else "the install failed"
no_cuda = "no nvcc given" if not args.nvcc else None
native = tmp / "native.ini"
native.write_text(f"[binaries]\ncuda = '{args.nvcc}'\n" if args.nvcc else "[binaries]\n")


# 2. CMake: find_package(moefold 0.1 CONFIG) from the moved prefix.
def cmake_consumer(with_cuda):
    def go():
        d = copy_project("cmake_consumer") if not with_cuda else tmp / "cmake_consumer"
        b = d / ("build-cuda" if with_cuda else "build")
        comps = []
        defs = [f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF",
                f"-DCMAKE_CXX_COMPILER={args.cxx}"]
        if args.mpi:
            comps.append("MPI")
        if with_cuda:
            comps.append("CUDA")
            if args.nccl:
                comps.append("NCCL")
            defs.append(f"-DCMAKE_CUDA_COMPILER={args.nvcc}")
        defs.append("-DMOEFOLD_CONSUMER_COMPONENTS=" + ";".join(comps))
        run([args.cmake, "-G", "Ninja", "-S", d, "-B", b] + defs)
        run([args.cmake, "--build", b] + (["--target", "consumer_kernels"] if with_cuda else []))
        out = run([b / ("consumer_kernels" if with_cuda else "consumer")]).strip()
        n = check_out_of_reach(b, prefix)
        return f"{out} [{n} moefold headers, all from the moved prefix; components {comps or 'none'}]"
    return go


# 3. meson through pkg-config, from the moved prefix's moefold.pc only.
def pkgconfig_consumer():
    d = copy_project("meson_consumer", "pkgconfig_consumer")
    b = d / "build"
    cuda = ["-Dkernels=true"] if args.nvcc else []
    run(meson + ["setup", b, d, "--native-file", native, "-Dfrom=pkg-config"] + cuda,
        extra_env={"PKG_CONFIG_LIBDIR": str(state["pcdir"])})
    run(["ninja", "-C", b])
    out = [run([b / "consumer"]).strip()]
    if args.nvcc:
        out.append(run([b / "consumer-kernels"]).strip())
    n = check_out_of_reach(b, prefix)
    return "; ".join(out) + f" [{n} moefold headers, all from the moved prefix]"


# 4. meson subproject from a wrap file; the source package is in subprojects/packagecache, so
# meson checks its hash and unpacks it without downloading.
def subproject_consumer():
    d = copy_project("meson_consumer", "subproject_consumer")
    cache = d / "subprojects" / "packagecache"
    cache.mkdir(parents=True)
    tarball = cache / "moefold-0.1.0.tar.gz"
    skip_top = lambda p: p.name.startswith("build") or p.name in (".git", "subprojects")
    with tarfile.open(tarball, "w:gz") as t:
        for p in sorted(source.iterdir()):
            if skip_top(p):
                continue
            t.add(p, arcname=f"moefold-0.1.0/{p.name}",
                  filter=lambda i: None if "__pycache__" in i.name or i.name.endswith(".log") else i)
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    (d / "subprojects" / "moefold.wrap").write_text(
        (here / "meson_consumer" / "moefold.wrap.in").read_text()
        .replace("@URL@", tarball.as_uri()).replace("@HASH@", digest))
    b = d / "build"
    cuda = ["-Dkernels=true"] if args.nvcc else []
    log = run(meson + ["setup", b, d, "--native-file", native, "-Dfrom=subproject"] + cuda,
              extra_env={"PKG_CONFIG_LIBDIR": str(empty_pc)})
    if "Executing subproject moefold" not in log:
        raise Failure("moefold was not taken as a subproject:\n" + log[-2000:])
    targets = json.loads(run(meson + ["introspect", "--targets", b]))
    theirs = sorted(t["name"] for t in targets if t.get("subproject"))
    if theirs:
        raise Failure(f"the subproject built its own targets (tests/examples should be off): {theirs[:8]}")
    tests = json.loads(run(meson + ["introspect", "--tests", b]))
    if tests:
        raise Failure(f"the subproject registered {len(tests)} tests")
    run(["ninja", "-C", b])
    out = [run([b / "consumer"]).strip()]
    if args.nvcc:
        out.append(run([b / "consumer-kernels"]).strip())
    n = check_out_of_reach(b, d / "subprojects" / "moefold-0.1.0")
    return "; ".join(out) + f" [{n} moefold headers, all from the unpacked wrap]"


case("CMake: find_package(moefold 0.1 CONFIG)", cmake_consumer(False), no_install)
case("CMake: COMPONENTS CUDA, kernels.cu", cmake_consumer(True), no_install or no_cuda)
case("meson: dependency('moefold') through pkg-config", pkgconfig_consumer, no_install)
case("meson: moefold as a subproject (wrap file)", subproject_consumer)

if failed == 0 and not args.keep:
    shutil.rmtree(tmp, ignore_errors=True)
else:
    print(f"(kept {tmp})")
total = passed + failed + skipped
print(f"[doctest] test cases: {total} | {passed} passed | {failed} failed | {skipped} skipped")
sys.exit(1 if failed else 0)
