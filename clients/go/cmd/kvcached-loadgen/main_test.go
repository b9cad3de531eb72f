package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// The load generator against a real host-backend daemon: it must run for
// its duration, verify every page and report a JSON result with ops.
func TestLoadgenAgainstDaemon(t *testing.T) {
	repo, _ := filepath.Abs("../../../..")
	serve := filepath.Join(repo, ".venv", "bin", "kvcached-serve")
	if _, err := os.Stat(serve); err != nil {
		t.Fatalf("%s not found: run scripts/setup.sh", serve)
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "k.sock")
	d := exec.Command(serve, "--socket", sock, "--backend", "host", "--memory-limit", "256MiB")
	var log bytes.Buffer // read only after Wait
	d.Stdout, d.Stderr = &log, &log
	if err := d.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		d.Process.Signal(os.Interrupt)
		d.Wait()
		if t.Failed() {
			t.Logf("daemon log:\n%s", log.String())
		}
	}()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(sock + ".fd"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("daemon did not start")
		}
	}
	time.Sleep(200 * time.Millisecond)
	bin := filepath.Join(dir, "loadgen")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "-socket", sock, "-runners", "3", "-layers", "2", "-ctx", "8192", "-duration", "1500ms", "-json").Output()
	if err != nil {
		t.Fatalf("loadgen: %v\n%s", err, out)
	}
	var res result
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if res.Ops == 0 || res.PagesMapped == 0 || res.PagesMapped != res.PagesFreed || res.BadPages != 0 || res.Errors != 0 ||
		res.CheckedPages == 0 || res.Latency["grow"].Count == 0 || res.DurationS < 1.5 || res.DurationS > 10 {
		t.Fatalf("result: %s", out)
	}
	t.Logf("%.0f ops/s, grow p50 %.0fus p99 %.0fus", res.OpsPerSec, res.Latency["grow"].P50, res.Latency["grow"].P99)
}
