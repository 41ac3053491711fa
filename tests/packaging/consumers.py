#!/usr/bin/env python3
"""Consumer tests of an installed moefold.

Installs the build (meson install with DESTDIR), moves the installed tree to another directory,
and then builds and runs, against that moved copy only, three small projects: one with CMake
(find_package), and one with meson (meson_consumer) twice: through pkg-config, and with moefold
as a subproject from a wrap file (its source package in subprojects/packagecache). Each builds
consumer.cpp (the mesh and the CPU layer) and, when nvcc is given, kernels.cu (the kernel headers).
When the build has moefold_cutlass_sm90 (--cutlass DIR, the CUTLASS headers it was built with),
cutlass_sm90.cu is built against the installed library through CMake (component CUTLASS_SM90)
and pkg-config (moefold-cutlass-sm90.pc), and its executable must define the library's entry
points; the subproject's dependency('moefold-cutlass-sm90') is checked at configure level (see
subproject_cutlass). An install without the library (this build's, or a copy of it without the
library) must make CMake's REQUIRED component CUTLASS_SM90 fail with its reason. No header may
come from the source or build tree: every header each build read (ninja -t deps; for meson's nvcc
objects, their compile command with -M) is checked. Each check is one case of the doctest-style
summary line at the end.

Usage: consumers.py --source S --build B --meson MESON --cmake CMAKE --cxx CXX
                    [--nvcc NVCC] [--nccl] [--mpi] [--cutlass DIR]"""
import argparse
import hashlib
import json
import os
import re
import pathlib
import shlex
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
ap.add_argument("--cutlass", default="",
                help="the build has moefold_cutlass_sm90, built with the CUTLASS headers in DIR")
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


def headers_preprocessed(build_dir, obj):
    """Every file nvcc reads for the object `obj`, from its compile command run with -M: meson
    1.0's nvcc rule names a depfile but does not have nvcc write one, so ninja has no deps."""
    commands = run(["ninja", "-C", build_dir, "-t", "commands", obj]).strip().splitlines()
    cmd = shlex.split(commands[-1])
    i = cmd.index("-o")
    del cmd[i:i + 2]
    cmd.remove("-c")
    words = run(cmd + ["-M"], cwd=build_dir).replace("\\\n", " ").split()
    return {(pathlib.Path(build_dir) / w).resolve() for w in words if not w.endswith(":")}


def check_out_of_reach(build_dir, must_come_from, cuda_objects=()):
    deps = headers_read(build_dir)
    for obj in cuda_objects:
        deps |= headers_preprocessed(build_dir, obj)
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
    # The CUTLASS library and its .pc are installed exactly when the build has them.
    cutlass_files = list(prefix.rglob("libmoefold_cutlass_sm90.a"))
    cutlass_pcs = list(prefix.rglob("moefold-cutlass-sm90.pc"))
    if bool(args.cutlass) != bool(cutlass_files) or bool(args.cutlass) != bool(cutlass_pcs):
        held = [str(f.relative_to(prefix)) for f in cutlass_files + cutlass_pcs]
        raise Failure(f"the build {'has' if args.cutlass else 'has no'} moefold_cutlass_sm90, but "
                      f"the install holds {held}")
    if cutlass_pcs and cutlass_pcs[0].parent != pcs[0].parent:
        raise Failure("moefold-cutlass-sm90.pc is not next to moefold.pc")
    pcs += cutlass_pcs
    if "Apache License" not in (prefix / "share/doc/moefold/LICENSE").read_text():
        raise Failure("LICENSE is not the Apache-2.0 text")
    # Relocatable: no installed metadata names where it was built or first installed.
    for f in pcs + list((prefix / "share/cmake/moefold").iterdir()):
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


# The meson consumer's nvcc objects, whose headers check_out_of_reach finds with nvcc -M.
MESON_KERNELS_OBJ = "consumer-kernels.p/kernels.cu.o"
MESON_CUTLASS_OBJ = "consumer-cutlass.p/cutlass_sm90.cu.o"


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
    n = check_out_of_reach(b, prefix, [MESON_KERNELS_OBJ] if args.nvcc else [])
    return "; ".join(out) + f" [{n} moefold headers, all from the moved prefix]"


# 4. meson subproject from a wrap file; the source package is in subprojects/packagecache, so
# meson checks its hash and unpacks it without downloading. The package is what a release holds:
# not the build trees, git, or .deps (where scripts/setup.sh puts CUTLASS).
def wrap_project():
    d = tmp / "subproject_consumer"
    if d.exists():
        return d
    d = copy_project("meson_consumer", "subproject_consumer")
    cache = d / "subprojects" / "packagecache"
    cache.mkdir(parents=True)
    tarball = cache / "moefold-0.1.0.tar.gz"
    skip_top = lambda p: p.name.startswith("build") or p.name in (".git", ".deps", "subprojects")
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
    return d


def subproject_consumer():
    d = wrap_project()
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
    n = check_out_of_reach(b, d / "subprojects" / "moefold-0.1.0",
                           [MESON_KERNELS_OBJ] if args.nvcc else [])
    return "; ".join(out) + f" [{n} moefold headers, all from the unpacked wrap]"


# 5. The CUTLASS library (--cutlass): cutlass_sm90.cu keeps cutlass_sm90's run path on cuda_exec,
# so its link needs the library's three entry points. Without a GPU nothing runs (the program
# says so): what is checked is that it compiled with MOEFOLD_CUTLASS_SM90 (a static_assert), that
# the link took the library from where it should, and that the entry points are defined in the
# executable.
ENTRY_POINTS = ("kk_bf16", "kn_bf16", "mn_f32")


def check_cutlass_link(build_dir, target, exe, lib_root):
    """The link of `target` names libmoefold_cutlass_sm90 under lib_root only (as a file, or as
    -l with its -L), and `exe` defines the three entry points."""
    link = run(["ninja", "-C", build_dir, "-t", "commands", target]).strip().splitlines()[-1]
    words = shlex.split(link)
    # As a file, also inside an option (nvcc links with -Xlinker=PATH).
    libs = [pathlib.Path(build_dir, w).resolve()
            for w in re.findall(r"[^\s=,]*libmoefold_cutlass_sm90\.a", " ".join(words))]
    if "-lmoefold_cutlass_sm90" in words:
        libs += [pathlib.Path(build_dir, w[2:]).resolve() / "libmoefold_cutlass_sm90.a"
                 for w in words if w.startswith("-L")
                 and (pathlib.Path(build_dir, w[2:]) / "libmoefold_cutlass_sm90.a").exists()]
    if not libs or not all(l.is_relative_to(lib_root) and l.exists() for l in libs):
        raise Failure(f"the link of {target} does not take libmoefold_cutlass_sm90.a from "
                      f"{lib_root}: {libs}\n{link}")
    for bad in (source, build):
        if str(bad) in link:
            raise Failure(f"the link of {target} names {bad}:\n{link}")
    defined = run(["nm", "--defined-only", "-C", exe])
    missing = [e for e in ENTRY_POINTS if not re.search(
        r"\sT moefold::v\w+::detail::cutlass_sm90_run_" + e + r"\(", defined)]
    if missing:
        raise Failure(f"{exe.name} does not define the entry points {missing}")
    where = libs[0].relative_to(lib_root.parent)
    return f"{len(ENTRY_POINTS)} entry points defined, from {where}"


def cmake_cutlass():
    d = tmp / "cmake_consumer"
    if not d.exists():
        copy_project("cmake_consumer")
    b = d / "build-cutlass"
    # CUTLASS_SM90 alone: it implies CUDA (the CMakeLists checks that moefold::cuda exists).
    run([args.cmake, "-G", "Ninja", "-S", d, "-B", b, f"-DCMAKE_PREFIX_PATH={prefix}",
         "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF", f"-DCMAKE_CXX_COMPILER={args.cxx}",
         f"-DCMAKE_CUDA_COMPILER={args.nvcc}", "-DMOEFOLD_CONSUMER_COMPONENTS=CUTLASS_SM90"])
    run([args.cmake, "--build", b, "--target", "consumer_cutlass"])
    out = run([b / "consumer_cutlass"]).strip()
    linked = check_cutlass_link(b, "consumer_cutlass", b / "consumer_cutlass", prefix)
    n = check_out_of_reach(b, prefix)
    return f"{out}; {linked} [{n} moefold headers, all from the moved prefix]"


def pkgconfig_cutlass():
    d = tmp / "pkgconfig_consumer"
    if not d.exists():
        copy_project("meson_consumer", "pkgconfig_consumer")
    b = d / "build-cutlass"
    run(meson + ["setup", b, d, "--native-file", native, "-Dfrom=pkg-config", "-Dcutlass=true"],
        extra_env={"PKG_CONFIG_LIBDIR": str(state["pcdir"])})
    run(["ninja", "-C", b, "consumer-cutlass"])
    out = run([b / "consumer-cutlass"]).strip()
    linked = check_cutlass_link(b, "consumer-cutlass", b / "consumer-cutlass", prefix)
    n = check_out_of_reach(b, prefix, [MESON_CUTLASS_OBJ])
    return f"{out}; {linked} [{n} moefold headers, all from the moved prefix]"


# The subproject at configure level: building it compiles CUTLASS's three units again (about
# 5 minutes of CI's two cores, more than this test may take), so the parent is configured with
# moefold:cuda=enabled and moefold:cutlass, and the check is that
# dependency('moefold-cutlass-sm90') resolved to the subproject's library: the subproject defines
# only the units and the library, ninja's plan for consumer-cutlass builds the units, archives
# them and links the archive, and cutlass_sm90.cu compiles against the unpacked wrap with
# MOEFOLD_CUTLASS_SM90 (its static_assert); only that object is built.
def subproject_cutlass():
    d = wrap_project()
    b = d / "build-cutlass"
    log = run(meson + ["setup", b, d, "--native-file", native, "-Dfrom=subproject",
                       "-Dcutlass=true", "-Dmoefold:cuda=enabled",
                       f"-Dmoefold:cutlass={args.cutlass}"],
              extra_env={"PKG_CONFIG_LIBDIR": str(empty_pc)})
    if "Executing subproject moefold" not in log:
        raise Failure("moefold was not taken as a subproject:\n" + log[-2000:])
    targets = json.loads(run(meson + ["introspect", "--targets", b]))
    theirs = sorted(t["name"] for t in targets if t.get("subproject"))
    want = sorted(["moefold_cutlass_sm90"] + [f"cutlass-sm90-{e}" for e in ENTRY_POINTS])
    if theirs != want:
        raise Failure(f"the subproject's targets are {theirs}, not {want}")
    if json.loads(run(meson + ["introspect", "--tests", b])):
        raise Failure("the subproject registered tests")
    plan = run(["ninja", "-C", b, "-n", "consumer-cutlass"])
    lib = "subprojects/moefold-0.1.0/libmoefold_cutlass_sm90.a"
    inputs = run(["ninja", "-C", b, "-t", "query", "consumer-cutlass"])
    units = [e for e in ENTRY_POINTS
             if f"Generating subprojects/moefold-0.1.0/cutlass-sm90-{e}" in plan]
    if lib not in inputs or units != list(ENTRY_POINTS):
        raise Failure(f"consumer-cutlass does not link the subproject's library built from its "
                      f"units (units in the plan: {units})\n{inputs}\n{plan}")
    if MESON_CUTLASS_OBJ not in inputs:
        raise Failure(f"{MESON_CUTLASS_OBJ} is not among consumer-cutlass's inputs:\n{inputs}")
    run(["ninja", "-C", b, MESON_CUTLASS_OBJ])
    if any((b / lib).parent.glob("cutlass_sm90_*.o")):
        raise Failure("compiling the consumer's object built CUTLASS's units")
    n = check_out_of_reach(b, d / "subprojects" / "moefold-0.1.0", [MESON_CUTLASS_OBJ])
    return (f"resolved to the subproject's {pathlib.Path(lib).name}, its 3 units planned, "
            f"cutlass_sm90.cu compiled [{n} moefold headers, all from the unpacked wrap]")


# An install without the library (this build's when it has none, else a copy of the moved prefix
# without it): the REQUIRED component fails the find with the reason, the library's path, in
# CMake's message.
def cmake_cutlass_missing():
    bare = prefix
    if args.cutlass:
        bare = tmp / "moved" / "moefold-0.1-no-cutlass"
        shutil.copytree(prefix, bare, symlinks=True, ignore=shutil.ignore_patterns(
            "libmoefold_cutlass_sm90.a", "moefold-cutlass-sm90.pc", "bin"))
    d = tmp / "cmake_consumer"
    if not d.exists():
        copy_project("cmake_consumer")
    b = d / "build-no-cutlass"
    cmd = [args.cmake, "-G", "Ninja", "-S", d, "-B", b, f"-DCMAKE_PREFIX_PATH={bare}",
           "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF", f"-DCMAKE_CXX_COMPILER={args.cxx}",
           "-DMOEFOLD_CONSUMER_COMPONENTS=CUTLASS_SM90"]
    if args.nvcc:
        cmd.append(f"-DCMAKE_CUDA_COMPILER={args.nvcc}")
    r = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True)
    text = " ".join((r.stdout + r.stderr).split())  # CMake wraps its messages
    lib = state["pcdir"].parent.relative_to(prefix) / "libmoefold_cutlass_sm90.a"
    want = (f"moefold: component CUTLASS_SM90 was requested but this install has no "
            f"{bare / lib}: moefold was built without the CUTLASS headers")
    if r.returncode == 0 or want not in text:
        raise Failure(f"exit {r.returncode}; expected the message\n  {want}\n{r.stdout[-2000:]}"
                      f"\n{r.stderr[-3000:]}")
    return "NOT found, with the library's path as the reason" + (
        " (a copy of the install without it)" if args.cutlass else "")


case("CMake: find_package(moefold 0.1 CONFIG)", cmake_consumer(False), no_install)
case("CMake: COMPONENTS CUDA, kernels.cu", cmake_consumer(True), no_install or no_cuda)
case("meson: dependency('moefold') through pkg-config", pkgconfig_consumer, no_install)
case("meson: moefold as a subproject (wrap file)", subproject_consumer)
no_cutlass = None if args.cutlass else "the build has no moefold_cutlass_sm90"
case("CMake: COMPONENTS CUTLASS_SM90, cutlass_sm90.cu linked", cmake_cutlass,
     no_install or no_cuda or no_cutlass)
case("meson: moefold-cutlass-sm90 through pkg-config, cutlass_sm90.cu linked", pkgconfig_cutlass,
     no_install or no_cuda or no_cutlass)
case("meson: moefold-cutlass-sm90 from the subproject (configure level)", subproject_cutlass,
     no_cuda or no_cutlass)
case("CMake: COMPONENTS CUTLASS_SM90 refused by an install without the library",
     cmake_cutlass_missing, no_install)

if failed == 0 and not args.keep:
    shutil.rmtree(tmp, ignore_errors=True)
else:
    print(f"(kept {tmp})")
total = passed + failed + skipped
print(f"[doctest] test cases: {total} | {passed} passed | {failed} failed | {skipped} skipped")
sys.exit(1 if failed else 0)
