#!/bin/sh
# Palisade .rpm: after erase ($1 = 0) or upgrade ($1 >= 1). Like every rpm
# erase it keeps the logs, a changed configuration (palisade.toml.rpmsave)
# and the cluster key; docs/deploy.md ("Removing Palisade") lists them.
if [ -d /run/systemd/system ]; then
	systemctl daemon-reload >/dev/null 2>&1 || true
fi
exit 0
