#!/bin/sh
# Palisade package: before removal (deb: "remove" or "upgrade NEW-VERSION";
# rpm: $1 = 0 on removal, >= 1 on upgrade). An upgrade keeps everything in
# force. A removal stops the services and removes the pinned eBPF programs
# and the nft table: without the binary nothing could manage or remove them.
set -e
case "$1" in
remove | 0) ;;
*) exit 0 ;;
esac
if [ -d /run/systemd/system ]; then
	systemctl disable --now palisade-agent.service palisade-ident.service palisade-gateway.service >/dev/null 2>&1 || true
fi
palisade agent --uninstall >/dev/null 2>&1 || true
exit 0
