// kstatus-check reads KVOffloadServes from the API server and prints what kstatus makes of them:
// the same library and version Helm v4.3.1 waits with (github.com/fluxcd/cli-utils, the fork
// Flux uses too), so its verdict is the one `helm install --wait` and a Flux Kustomization see.
//
//	kstatus-check -kubeconfig K -n NS [-resource kvoffloadserves.v1alpha1.kvoffload.io] NAME...
//
// Prints one JSON line per object: {"name", "status", "message", "conditions"}; a missing object
// reads NotFound. With -file, it computes the status of objects in a file instead ('-': stdin).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/fluxcd/cli-utils/pkg/kstatus/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/yaml"
)

type verdict struct {
	Name       string             `json:"name"`
	Status     string             `json:"status"`
	Message    string             `json:"message"`
	Conditions []status.Condition `json:"conditions"`
}

func compute(u *unstructured.Unstructured) verdict {
	res, err := status.Compute(u)
	if err != nil {
		return verdict{Name: u.GetName(), Status: "Error", Message: err.Error()}
	}
	return verdict{Name: u.GetName(), Status: res.Status.String(), Message: res.Message, Conditions: res.Conditions}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "kstatus-check:", err)
	os.Exit(2)
}

func main() {
	kubeconfig := flag.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig file")
	namespace := flag.String("n", "default", "namespace")
	resource := flag.String("resource", "kvoffloadserves.v1alpha1.kvoffload.io", "resource.version.group")
	file := flag.String("file", "", "compute from a YAML/JSON file of one object instead of the API ('-': stdin)")
	flag.Parse()
	enc := json.NewEncoder(os.Stdout)

	if *file != "" {
		var data []byte
		var err error
		if *file == "-" {
			data, err = io.ReadAll(os.Stdin)
		} else {
			data, err = os.ReadFile(*file)
		}
		if err != nil {
			fail(err)
		}
		js, err := yaml.YAMLToJSON(data)
		if err != nil {
			fail(err)
		}
		u := &unstructured.Unstructured{} // as the API client decodes: integers stay int64
		if err := u.UnmarshalJSON(js); err != nil {
			fail(err)
		}
		_ = enc.Encode(compute(u))
		return
	}

	gvr, _ := schema.ParseResourceArg(*resource)
	if gvr == nil {
		fail(fmt.Errorf("-resource %q: want resource.version.group", *resource))
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fail(err)
	}
	client, err := dynamic.NewForConfig(cfg)
	if err != nil {
		fail(err)
	}
	for _, name := range flag.Args() {
		u, err := client.Resource(*gvr).Namespace(*namespace).Get(context.Background(), name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			_ = enc.Encode(verdict{Name: name, Status: status.NotFoundStatus.String(), Message: "not found"})
		case err != nil:
			fail(err)
		default:
			_ = enc.Encode(compute(u))
		}
	}
}
