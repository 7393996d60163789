"""The local provisioner: each instance a real PostgreSQL server on this machine, own directory and port.

The package is cut by what each part owns; each module imports only those above it here:

- `storage`: the instances' directories, their state files (secrets sealed), who owns the files;
- `network`: the servers' hosts, each instance's port, the access rules (`pg_hba.conf`);
- `tls`: the control plane's CA and each server's certificate;
- `database`: the admin role's sessions and client tools, the customer's owner role and database;
- `server`: the server lifecycle (initdb, managed settings, start, stop, standby mode, processes);
- `backups`: base backups, retention, restore in place, the final dump of a deletion;
- `steps`: the async/sync seam (`step`, `in_thread`), the one place a step body meets the event loop;
- `provisioner`: `LocalProvisioner`, the interface's steps composed of the parts.

A new part (a WAL archiver, streaming standbys, a connection pooler) is a module of its own beside
these, composed in `LocalProvisioner`; its steps are synchronous bodies under `step`.
"""

from provisioners.local.database import owner_role
from provisioners.local.provisioner import LocalProvisioner
from provisioners.local.server import InstanceServer, postmaster_pids_for
from provisioners.local.tls import SERVER_CERT

__all__ = ["SERVER_CERT", "InstanceServer", "LocalProvisioner", "owner_role", "postmaster_pids_for"]
