package slurmconf

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestRead(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "slurm.conf")
	os.WriteFile(p, []byte("# test\nClusterName=x\nslurmuser=slurm  # comment\nSlurmdUser=root\nSrunPortRange=61000-62999\nNodeName=n1 CPUs=2\n"), 0o644)
	c, err := Read(p)
	if err != nil {
		t.Fatal(err)
	}
	if c.SlurmUser != "slurm" || c.SlurmdUser != "root" || c.SrunFirst != 61000 || c.SrunLast != 62999 {
		t.Errorf("got %+v", c)
	}
	if !slices.Equal(c.Accounts(), []string{"slurm", "root"}) {
		t.Errorf("accounts %v", c.Accounts())
	}

	os.WriteFile(p, []byte("ClusterName=x\n"), 0o644)
	if c, err = Read(p); err != nil || c.SlurmUser != "root" || c.SrunPortRange != "" || !slices.Equal(c.Accounts(), []string{"root"}) {
		t.Errorf("defaults: %+v %v", c, err)
	}
	for _, bad := range []string{"SrunPortRange=62999-61000", "SrunPortRange=61000", "SrunPortRange=0-5", "SrunPortRange=1-70000"} {
		os.WriteFile(p, []byte(bad+"\n"), 0o644)
		if _, err := Read(p); err == nil {
			t.Errorf("%s: no error", bad)
		}
	}
	if _, err := Read(filepath.Join(dir, "missing")); err == nil {
		t.Error("missing file: no error")
	}
}
