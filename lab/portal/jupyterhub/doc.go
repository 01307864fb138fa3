// Package jupyterhub tests JupyterHub with batchspawner under Palisade on the
// testbed (issue 24, docs/portals.md): the hub and its configurable-http-proxy
// on the portal node (node1) as a service account that is not exempt,
// single-user servers as Slurm jobs on the compute nodes, a Dask scheduler
// and dashboard in a job, and users who try to reach each other's servers
// through the portal and around it. Everything comes from the registries
// (.ci/deps installs /opt/pal-hub); the test is in hub_test.go.
package jupyterhub
