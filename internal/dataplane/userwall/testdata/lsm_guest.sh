# Guest side of TestLSMVM (bash, root, in the bare VM). $1 = palisade binary,
# $2 = the directory with lsm_guest.py and userwall.test.
bin=$1 dir=$2
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
nsenter --net=/run/netns/palulA -- $bin agent --uninstall --config $w/palisade.toml > $w/uninstall.log 2>&1
echo "UNINSTALL exit $?: $(tr '\n' ' ' < $w/uninstall.log)"
nsenter --net=/run/netns/palulA -- env PALISADE_LSM_GUEST=$dir $dir/userwall.test -test.run '^TestLSMGuest$' -test.v -test.count=1
rc=$?
echo "DMESG"; dmesg | grep -i -E 'bpf|lsm|lockdown' | tail -5
ip netns del palulA; ip netns del palulB
echo "GUEST-DONE rc=$rc"
exit $rc
