"""The local provisioner: each instance a real PostgreSQL server on this machine, own directory and port.

The package is cut by what each part owns; each module imports only those above it here:

- `storage`: the instances' directories, their state files (secrets sealed), who owns the files;
- `network`: the servers' hosts, each instance's port, the access rules (`pg_hba.conf`);
- `tls`: the control plane's CA and each server's certificate;
- `database`: the admin role's sessions and client tools, the customer's owner role and database;
- `wal`: WAL positions and how far the archive covers an instance's writes (pure);
- `repository`: the pgBackRest repository (encrypted, its key sealed), each instance's stanza and
  record, the pgBackRest commands;
- `server`: the server lifecycle (initdb, managed settings with the archive's, start, stop, standby
  mode, processes);
- `backups`: the continuous archive's health, full and differential backups and their retention,
  restores in place and into a new instance, verification, the final backup of a deletion;
- `replication`: the servers' names and a primary's and its standbys' replication settings (pure);
- `standbys`: an HA plan's standbys (seeded, started, watched) and the failover's fence and promotion;
- `pooler`: an HA plan's PgBouncer, its stable endpoint, pointed at the current primary;
- `steps`: the async/sync seam (`step`, `in_thread`), the one place a step body meets the event loop;
- `provisioner`: `LocalProvisioner`, the interface's steps composed of the parts.

A new part is a module of its own beside these, composed in `LocalProvisioner`; its steps are
synchronous bodies under `step`.
"""

from provisioners.local.database import owner_role
from provisioners.local.provisioner import LocalProvisioner
from provisioners.local.server import InstanceServer, postmaster_pids_for
from provisioners.local.tls import SERVER_CERT

__all__ = ["SERVER_CERT", "InstanceServer", "LocalProvisioner", "owner_role", "postmaster_pids_for"]
