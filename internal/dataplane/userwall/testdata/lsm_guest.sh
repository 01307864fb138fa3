# Guest side of TestLSMVM (bash, root, in the bare VM). $1 = palisade binary,
# $2 = the directory with lsm_guest.py and userwall.test, $3 = a palisade
# binary with another map layout (-tags palisade_layout_next).
bin=$1 dir=$2 next=$3
mountpoint -q /sys/kernel/security || mount -t securityfs securityfs /sys/kernel/security
echo "LSM $(cat /sys/kernel/security/lsm)"
echo "KERNEL $(uname -r)"
ip netns add palulA && ip netns add palulB || exit 1
# The full agent, for the record (it loads on 6.1 since data plane v2), then
# uninstalled: its pinned programs (default policy, root alone exempt) would
# otherwise keep enforcing in palulA beside the test's own LSM programs.
w=/tmp/palul; mkdir -p $w
printf '[agent]\npid_file = "%s/agent.pid"\nevent_log = ""\nmetrics_address = ""\nident_port = 0\nident_socket = ""\nsyslog = false\n' $w > $w/palisade.toml
timeout 30 nsenter --net=/run/netns/palulA -- $bin agent --config $w/palisade.toml > $w/agent.log 2>&1
echo "AGENT exit $?: $(tr '\n' ' ' < $w/agent.log)"
# An upgrade across a changed map layout with the LSM links attached (the
# host cannot attach them): N+1 migrates what N pinned; LSM links cannot be
# updated, so its new ones are staged and replace N's at commit.
start_agent() { # $1 binary, $2 log name: returns once the agent enforces (its pid file)
	nsenter --net=/run/netns/palulA -- $1 agent --config $w/palisade.toml >> $w/$2.log 2>&1 &
	for i in $(seq 1200); do [ -s $w/agent.pid ] && return 0; kill -0 $! 2>/dev/null || break; sleep 0.25; done
	echo "agent $2 did not start: $(tr '\n' ' ' < $w/$2.log)"; return 1
}
stop_agent() {
	p=$(cat $w/agent.pid); kill -TERM $p; while kill -0 $p 2>/dev/null; do sleep 0.1; done
}
lsm_links() {
	nsenter --net=/run/netns/palulA -- $bin status --json --config $w/palisade.toml |
		python3 -c 'import json,sys; s=json.load(sys.stdin); print(" ".join(sorted("%s=%d" % (l["name"], l["prog_id"]) for l in s["links"] if l["name"].startswith("lsm_"))), "unix_enforced=%s" % s["unix_enforced"])'
}
if [ -n "$next" ] && start_agent $bin n; then
	echo "UPGRADE-BEFORE $(lsm_links)"
	nsenter --net=/run/netns/palulA -- python3 $dir/reuse_guest.py
	stop_agent
	if start_agent $next next; then
		echo "UPGRADE-AFTER $(lsm_links)"
		echo "UPGRADE-COMMITTED $(grep -c 'migration committed' $w/next.log)"
		echo "UPGRADE-STAGED $(ls -d /sys/fs/bpf/palisade/*/next 2>/dev/null | wc -l)"
		stop_agent
	fi
fi
nsenter --net=/run/netns/palulA -- $bin agent --uninstall --config $w/palisade.toml > $w/uninstall.log 2>&1
echo "UNINSTALL exit $?: $(tr '\n' ' ' < $w/uninstall.log)"
nsenter --net=/run/netns/palulA -- env PALISADE_LSM_GUEST=$dir $dir/userwall.test -test.run '^TestLSMGuest$' -test.v -test.count=1
rc=$?
echo "DMESG"; dmesg | grep -i -E 'bpf|lsm|lockdown' | tail -5
ip netns del palulA; ip netns del palulB
echo "GUEST-DONE rc=$rc"
exit $rc
