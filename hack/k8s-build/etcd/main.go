// Command etcd is the upstream etcd server, built from its published Go module so that the
// local test control plane needs no downloaded release binaries.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
