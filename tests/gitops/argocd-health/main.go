// argocd-health runs an Argo CD resource health check (health.lua) the way Argo CD runs one
// taken from argocd-cm (`resource.customizations.health.<group>_<kind>`): gopher-lua with the
// standard libraries off except package, base and table (Argo CD's util/lua runLua), the object
// as the global `obj`, a one-second budget, and a returned table {status, message}.
//
// Two modes:
//
//	argocd-health -script health.lua -tests health_test.yaml
//	    Argo CD's own table form: tests[].inputPath (relative to the test file) and
//	    tests[].healthStatus {status, message}; prints one line per case, exits 1 on a mismatch.
//	argocd-health -script health.lua FILE...   ('-' reads stdin; YAML or JSON, a List is expanded)
//	    prints {"name", "status", "message"} per object as JSON lines.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	lua "github.com/yuin/gopher-lua"
	"sigs.k8s.io/yaml"
)

// Health is Argo CD's health.HealthStatus.
type Health struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

var valid = map[string]bool{"Healthy": true, "Progressing": true, "Degraded": true, "Suspended": true, "Missing": true, "Unknown": true}

// toLua mirrors Argo CD's decodeValue: maps become hash tables, lists arrays, numbers LNumber.
func toLua(l *lua.LState, v any) lua.LValue {
	switch x := v.(type) {
	case bool:
		return lua.LBool(x)
	case float64:
		return lua.LNumber(x)
	case int64:
		return lua.LNumber(x)
	case string:
		return lua.LString(x)
	case json.Number:
		return lua.LString(x)
	case []any:
		t := l.CreateTable(len(x), 0)
		for _, item := range x {
			t.Append(toLua(l, item))
		}
		return t
	case map[string]any:
		t := l.CreateTable(0, len(x))
		for k, item := range x {
			t.RawSetH(lua.LString(k), toLua(l, item))
		}
		return t
	}
	return lua.LNil
}

func evaluate(script string, obj map[string]any) (Health, error) {
	l := lua.NewState(lua.Options{SkipOpenLibs: true}) // as for argocd-cm scripts without useOpenLibs
	defer l.Close()
	for _, lib := range []struct {
		name string
		fn   lua.LGFunction
	}{{lua.LoadLibName, lua.OpenPackage}, {lua.BaseLibName, lua.OpenBase}, {lua.TabLibName, lua.OpenTable}} {
		if err := l.CallByParam(lua.P{Fn: l.NewFunction(lib.fn), NRet: 0, Protect: true}, lua.LString(lib.name)); err != nil {
			return Health{}, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	l.SetContext(ctx)
	l.SetGlobal("obj", toLua(l, obj))
	if err := l.DoString(script); err != nil {
		return Health{}, err
	}
	ret, ok := l.Get(-1).(*lua.LTable)
	if !ok {
		return Health{}, fmt.Errorf("expect table output from Lua script, not %s", l.Get(-1).Type())
	}
	h := Health{Status: lua.LVAsString(ret.RawGetString("status")), Message: lua.LVAsString(ret.RawGetString("message"))}
	if !valid[h.Status] {
		return Health{Status: "Unknown", Message: "Lua returned an invalid health status"}, nil
	}
	return h, nil
}

func readObjects(path string) ([]map[string]any, error) {
	var data []byte
	var err error
	if path == "-" {
		data, err = io.ReadAll(os.Stdin)
	} else {
		data, err = os.ReadFile(path)
	}
	if err != nil {
		return nil, err
	}
	var obj map[string]any
	if err := yaml.Unmarshal(data, &obj); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	kind, _ := obj["kind"].(string)
	if items, ok := obj["items"].([]any); ok && strings.HasSuffix(kind, "List") {
		out := make([]map[string]any, 0, len(items))
		for _, it := range items {
			if m, ok := it.(map[string]any); ok {
				out = append(out, m)
			}
		}
		return out, nil
	}
	return []map[string]any{obj}, nil
}

type table struct {
	Tests []struct {
		InputPath    string `json:"inputPath"`
		HealthStatus Health `json:"healthStatus"`
	} `json:"tests"`
}

func runTable(script, testsPath string) int {
	data, err := os.ReadFile(testsPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	var t table
	if err := yaml.UnmarshalStrict(data, &t); err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", testsPath, err)
		return 2
	}
	if len(t.Tests) == 0 {
		fmt.Fprintf(os.Stderr, "%s: no tests\n", testsPath)
		return 2
	}
	failed := 0
	for _, tc := range t.Tests {
		objs, err := readObjects(filepath.Join(filepath.Dir(testsPath), tc.InputPath))
		if err != nil || len(objs) != 1 {
			fmt.Printf("FAIL %s: cannot read one object: %v\n", tc.InputPath, err)
			failed++
			continue
		}
		got, err := evaluate(script, objs[0])
		switch {
		case err != nil:
			fmt.Printf("FAIL %s: %v\n", tc.InputPath, err)
			failed++
		case got != tc.HealthStatus:
			fmt.Printf("FAIL %s: got %s %q, want %s %q\n", tc.InputPath, got.Status, got.Message, tc.HealthStatus.Status, tc.HealthStatus.Message)
			failed++
		default:
			fmt.Printf("ok   %s: %s\n", tc.InputPath, got.Status)
		}
	}
	fmt.Printf("%d/%d passed\n", len(t.Tests)-failed, len(t.Tests))
	if failed > 0 {
		return 1
	}
	return 0
}

func main() {
	scriptPath := flag.String("script", "", "health.lua")
	tests := flag.String("tests", "", "health_test.yaml (Argo CD's table form)")
	flag.Parse()
	if *scriptPath == "" {
		fmt.Fprintln(os.Stderr, "usage: argocd-health -script health.lua (-tests health_test.yaml | FILE...)")
		os.Exit(2)
	}
	src, err := os.ReadFile(*scriptPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if *tests != "" {
		os.Exit(runTable(string(src), *tests))
	}
	enc := json.NewEncoder(os.Stdout)
	for _, path := range flag.Args() {
		objs, err := readObjects(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		for _, obj := range objs {
			h, err := evaluate(string(src), obj)
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
			name, _ := obj["metadata"].(map[string]any)["name"].(string)
			_ = enc.Encode(map[string]string{"name": name, "status": h.Status, "message": h.Message})
		}
	}
}
