"""The C++ Comm objects rfsdp builds over torch.distributed groups, and a safe
interpreter exit.

torch 2.11's Gloo worker threads drop their last reference to a finished
collective just after the caller wakes up. When that collective held a
Python-owned tensor and the interpreter is finalising by then, the worker is
stopped while asking for the GIL: "terminate called without an active
exception". Plain torch shows it (an optimizer, an all_reduce of a Python
tensor, a barrier, destroy_process_group: 2 exits in 40 aborted), and so did
rfsdp's 2-process tests (1 in 15), whose Comms also keep the group alive. At
exit, rfsdp closes its Comms and gives the workers a moment with the GIL
released, before finalisation (atexit handlers run while threads are still
served)."""
import atexit
import time
import weakref

from . import _C

_live = weakref.WeakSet()
_EXIT_GRACE_SECONDS = 0.05


def make_comm(process_group, timeout_seconds=300.0):
    """A Comm over a torch.distributed group. Keep the returned object as long as
    the C++ objects given it: rfsdp closes the Comms it knows of at exit."""
    comm = _C.Comm(process_group, float(timeout_seconds))
    _live.add(comm)
    return comm


def check_in(comm, what, timeout_seconds, lines=(), every="every rank"):
    """Every rank of comm's group has reached `what` (each with the same lines): one
    small all-reduce under comm's timeout, before a collective operation's first
    collective of torch's (whose group may wait 30 minutes). Else, on this rank, a
    RuntimeError "<what> is collective: call it on <every>, and not all did within
    <timeout> s: <the Comm's cause: a timeout or a closed peer>" (a rank that was never
    called cannot say so), or the ValueError of a line that differs, on every rank.
    On an NCCL group the group's own watchdog times the wait out."""
    try:
        _C.agree_lines(comm, [what] + list(lines), what)
    except RuntimeError as e:
        raise RuntimeError("%s is collective: call it on %s, and not all did within %g s: %s"
                           % (what, every, timeout_seconds, e)) from e


@atexit.register
def _close_all():
    comms = list(_live)
    for comm in comms:
        comm.close()
    if comms:
        time.sleep(_EXIT_GRACE_SECONDS)  # releases the GIL: workers finish their frees
