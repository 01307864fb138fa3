// Command mkpkg builds Palisade's .deb and .rpm (`make package`); see
// package packaging.
package main

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/packaging"
)

func main() {
	var o packaging.Options
	var formats, date string
	flag.StringVar(&o.Root, "root", ".", "source tree")
	flag.StringVar(&o.Binary, "bin", "bin/palisade", "built palisade binary")
	flag.StringVar(&o.SpankSO, "spank-so", "bin/pal_uvn_spank.so", "SPANK plugin built for Debian's Slurm (deb only; \"\" = none)")
	flag.StringVar(&o.Version, "version", "", "package version")
	flag.StringVar(&date, "date", os.Getenv("SOURCE_DATE_EPOCH"), "build time: RFC 3339 or seconds since the epoch")
	flag.StringVar(&o.OutDir, "out", "dist", "output directory")
	flag.StringVar(&formats, "formats", "deb,rpm", "package formats")
	flag.StringVar(&o.Maintainer, "maintainer", packaging.DefaultMaintainer, "the packages' maintainer: 'Name <address>'")
	flag.BoolVar(&o.NoDebug, "no-debug", false, "leave out the debug packages (-dbgsym, -debuginfo)")
	flag.Parse()
	if date != "" {
		t, err := time.Parse(time.RFC3339, date)
		if err != nil {
			s, serr := strconv.ParseInt(date, 10, 64)
			if serr != nil {
				fmt.Fprintf(os.Stderr, "mkpkg: -date %q: want RFC 3339 or epoch seconds\n", date)
				os.Exit(2)
			}
			t = time.Unix(s, 0)
		}
		o.Date = t.UTC()
	}
	o.Formats = strings.Split(formats, ",")
	out, err := packaging.Build(o)
	for _, p := range out {
		fmt.Println(p)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "mkpkg:", err)
		os.Exit(1)
	}
}
