"""How daemons get started and found — the engines place them; a launcher only starts or finds them and
hands their addresses and keys to a `RemoteMesh` (which is what the controller drives):

  local.py       daemons as subprocesses of this controller (`RemoteMesh.local`), with ephemeral keys over a pipe
  rendezvous.py  daemons that SLURM, Kubernetes or a shell loop started: gather their arrivals at a
                 rendezvous (a shared directory, or a TCP rendezvous served here), check, connect
                 (`RemoteMesh.from_rendezvous`)
  ray.py         daemons inside Ray actors on a placement group (`RemoteMesh.ray`, the `ray` extra)

A launcher is given the mesh class to construct (it never imports the mesh).
"""
