package kvcached

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// driverCalls reads this process's live call counters of the CUDA test
// driver (KVCACHED_TESTDRV_CALLS, set by TestMain; tests/cudadriver/README.md,
// "Live call counters"; layout in testdriver.c): calls per driver function
// since the driver was loaded, failed ones included (none before it is).
func driverCalls(t *testing.T) map[string]uint64 {
	t.Helper()
	if cudaCalls == "" {
		t.Fatal("no CUDA test driver: its call counters are not on")
	}
	return driverCallsOf(t, cudaCalls, os.Getpid())
}

// driverCallsOf reads the call counters process pid left in dir (its
// KVCACHED_TESTDRV_CALLS): they stay after the process exits.
func driverCallsOf(t *testing.T, dir string, pid int) map[string]uint64 {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, strconv.Itoa(pid)))
	if errors.Is(err, fs.ErrNotExist) {
		return map[string]uint64{} // the driver is not loaded yet: no call so far
	}
	if err != nil {
		t.Fatalf("the test driver's call counters: %v (is the driver loaded in this process?)", err)
	}
	le := binary.LittleEndian
	const magic, head = 0x314C4E4344565444, 32
	if len(data) < head || le.Uint64(data) != magic || le.Uint32(data[8:]) != 1 {
		t.Fatalf("the test driver's call counters: not a version 1 counter file (%d bytes)", len(data))
	}
	nfn, nameLen := int(le.Uint32(data[12:])), int(le.Uint32(data[20:]))
	calls := head + nfn*nameLen
	if len(data) < calls+16*nfn {
		t.Fatalf("the test driver's call counters: %d bytes for %d functions", len(data), nfn)
	}
	out := make(map[string]uint64, nfn)
	for i := 0; i < nfn; i++ {
		name := data[head+i*nameLen : head+(i+1)*nameLen]
		if j := bytes.IndexByte(name, 0); j >= 0 {
			name = name[:j]
		}
		out[string(name)] = le.Uint64(data[calls+8*i:])
	}
	return out
}

// callDelta is what each function was called between two driverCalls
// (functions not called are left out).
func callDelta(after, before map[string]uint64) map[string]uint64 {
	d := map[string]uint64{}
	for k, v := range after {
		if v != before[k] {
			d[k] = v - before[k]
		}
	}
	return d
}
