// Package ondemand tests Open OnDemand's node proxy path under Palisade
// (issue 24, docs/portals.md): a real Apache httpd on the portal node,
// configured like OnDemand's /rnode/<host>/<port>/ route through `palisade
// portal forward`, and real JupyterLab servers started through sbatch the
// way OnDemand's batch connect starts them.
package ondemand
