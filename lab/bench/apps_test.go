package bench

import "testing"

func TestAppParsers(t *testing.T) {
	rps, err := redisRPS("\"test\",\"rps\",\"avg_latency_ms\"\n\"GET\",\"45977.01\",\"0.150\"\n")
	if err != nil || rps != 45977.01 {
		t.Fatalf("redisRPS = %v, %v", rps, err)
	}
	if _, err := redisRPS("Error: Connection refused\n"); err == nil {
		t.Fatal("redisRPS accepted output without a GET line")
	}
	pg := "number of transactions actually processed: 72290\nnumber of failed transactions: 0 (0.000%)\nlatency average = 0.276 ms\ninitial connection time = 6.120 ms\ntps = 14457.123456 (without initial connection time)\n"
	tps, txs, err := pgbenchTPS(pg)
	if err != nil || tps != 14457.123456 || txs != 72290 {
		t.Fatalf("pgbenchTPS = %v, %v, %v", tps, txs, err)
	}
	if _, _, err := pgbenchTPS("pgbench: error: connection to server failed\n"); err == nil {
		t.Fatal("pgbenchTPS accepted output without a tps line")
	}
	if ns := childTimes("0m0.004000s 0m0.001000s\n0m1.250000s 1m0.500000s\n"); ns != 61.75e9 {
		t.Fatalf("childTimes = %v", ns)
	}
}
