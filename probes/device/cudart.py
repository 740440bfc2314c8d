"""The CUDA runtime library through ctypes, for the host-transfer probes (hostread.py, regpipe.py):
the system's libcudart, else the one in the Python environment's `nvidia` wheels."""
import ctypes


def load():
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    import nvidia, pathlib
    for p in pathlib.Path(nvidia.__path__[0]).rglob("libcudart.so*"):
        return ctypes.CDLL(str(p))
    raise OSError("no libcudart found")
